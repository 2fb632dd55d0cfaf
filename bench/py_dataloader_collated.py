"""torch DataLoader peer for BM_CollatedBatches: 2 workers each collate a batch of 64 samples (a
float32 tensor of batch bytes / 64, filled with the sample's index) with torch's default collate
(a stack in shared memory), prefetch_factor 2; the parent consumes the batches in order and reads
one element of each. Sizes 64 KiB, 1 MiB and 12 MiB per batch. Prints batches per second."""
import time, torch
from torch.utils.data import Dataset, DataLoader

SAMPLES = 64

class Samples(Dataset):
    def __init__(self, numel, n): self.numel, self.n = numel, n
    def __len__(self): return self.n
    def __getitem__(self, i): return torch.full((self.numel,), float(i))

def rate(nbytes, batches):
    loader = DataLoader(Samples(nbytes // 4 // SAMPLES, batches * SAMPLES), batch_size=SAMPLES,
                        num_workers=2, prefetch_factor=2, multiprocessing_context="fork")
    warm, t = 10, None
    for i, b in enumerate(loader):
        if i == warm: t = time.perf_counter()
        assert b[-1, 0].item() == float(i * SAMPLES + SAMPLES - 1)
    return (batches - warm) / (time.perf_counter() - t)

if __name__ == "__main__":
    torch.set_num_threads(1)
    for nbytes, n in [(64 << 10, 1000), (1 << 20, 500), (12 << 20, 100)]:
        print(f"torch DataLoader collated batch {nbytes >> 10} KiB: {rate(nbytes, n):.1f} batches/s")
