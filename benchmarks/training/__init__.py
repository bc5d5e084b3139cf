"""What pretraining costs and buys: step throughput, the wall-clock budget curve and the recipe search."""
