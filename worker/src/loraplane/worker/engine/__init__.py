"""The engine: model runner, sequences, continuous-batching scheduler, adapter residency."""
