"""Pure-Python GPU scheduler: snapshot model, placement policies, fair share, admission, trace replay."""
