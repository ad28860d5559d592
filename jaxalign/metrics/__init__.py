"""Trainer-engine gap metrics on arrays (NumPy only): log-prob mismatch (`mismatch`), routing agreement
(`routing`) and DSA index flips (`index`). The ground floor the RL loop, the alignment tools and the porting kit
all measure with."""
