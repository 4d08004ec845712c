"""What every reader and writer shares: dtypes, Source and TensorInfo, the search for the
weights in a checkpoint's tree, and torch tensor helpers."""
