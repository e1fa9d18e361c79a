"""The spine every sampler shares: canvas, loop, result, errors."""
