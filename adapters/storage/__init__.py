"""Where adapter versions are kept: the SQL registry (adapters and Medusa heads), their canonical blobs and the
object store (file:// or s3://)."""
