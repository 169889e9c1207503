def interactive(*a, **k): raise NotImplementedError
