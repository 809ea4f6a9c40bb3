"""`zerotrain train`: the command that trains a causal LM (`zerotrain.train.command`)."""
