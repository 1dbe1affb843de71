"""Single-digit sums for a pretrained instruct model: a chat agent with a checking tool whose
latency varies, and a second turn when the first answer is wrong."""
