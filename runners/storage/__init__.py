"""The storage layer's pure parts (no Django, no app): the content-addressed blob store that dataset
shards, checkpoint chunks and model weights lie in, and what works on it."""
