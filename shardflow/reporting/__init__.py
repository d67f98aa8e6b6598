"""What an operator reads beside the numbers: the plots of a run and of its model versions."""
