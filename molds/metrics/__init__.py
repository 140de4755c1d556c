"""TensorBoard writer with a JSONL mirror, throughput and MFU."""
