"""Per-sample cost of seeding in a DataLoader worker (CUDA not initialised there): torch.manual_seed
against torch.default_generator.manual_seed, side by side, 4,000 samples each, alternated 3 times."""
import json, sys, time
import torch
from torch.utils.data import DataLoader, Dataset

class Seed(Dataset):
    def __init__(self, how): self.how = how
    def __len__(self): return 4000
    def __getitem__(self, i):
        (torch.manual_seed if self.how == "torch.manual_seed" else torch.default_generator.manual_seed)(i)
        return torch.rand(1)

class Nothing(Seed):
    def __getitem__(self, i): return torch.rand(1)

rows = []
for rnd in range(3):
    for name, ds in [("torch.manual_seed", Seed("torch.manual_seed")), ("default_generator", Seed("default")), ("no seeding", Nothing("x"))]:
        loader = DataLoader(ds, batch_size=None, num_workers=1)
        it = iter(loader); next(it)  # the worker started
        t = time.perf_counter(); n = sum(1 for _ in it); s = time.perf_counter() - t
        rows.append({"round": rnd, "seeding": name, "us_per_sample": round(1e6 * s / n, 1)})
        print(json.dumps(rows[-1]), flush=True)
