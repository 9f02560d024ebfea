"""Hot ops: portable torch implementations, flash-attn on CUDA when it is installed."""
