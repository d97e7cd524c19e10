"""nn.Modules: the KDA layer, attention, MLP, norms. They read per-step metadata from `context`."""
