"""The training data plane: reads what ``molds-preprocess`` wrote."""
