"""What an adapter file means: PEFT's LoRA format (targets, ranks, DoRA, embedding and head LoRA), Medusa heads,
upload validation and summaries."""
