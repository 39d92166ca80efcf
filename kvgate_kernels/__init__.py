"""Hot ops. Each op has a torch reference (runs anywhere, the CPU path) whose signature the
Triton versions implement on GPU."""
