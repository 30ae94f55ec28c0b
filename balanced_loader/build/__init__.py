"""Writing shard folders: build-shards (tokenize files into webdataset shards + the length index), the shard writer, reindex, verify, and the corpora built from this machine's files."""
