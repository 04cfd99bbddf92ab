"""Training: state, jitted step (loss, gradients, balancing, optimizer), loop, evaluation, metrics."""
