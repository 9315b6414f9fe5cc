"""What a generation request asks for, parsed and checked before it costs anything: sampling parameters and
their bounds, cheap count prechecks, the prompt's token bound, response formats and tools."""
