"""What rank 0 tells: progress reports to the operator, METRICS lines, TensorBoard event files."""
