"""Loss and throughput since the last log, kept on the device so that logging is the only host synchronisation."""

import time
from collections import Counter
from contextlib import contextmanager

import torch


class ThroughputWindow:
    """Loss and token counts since the last log, kept on the device so that logging is the only sync."""

    def __init__(self, device):
        self.sums = torch.zeros(3, device=device)  # summed loss, its units, real (unpadded) tokens
        self.nonfinite = torch.zeros((), device=device)  # NaN or infinite losses so far, checked when syncing anyway
        self.samples = self.padded_tokens = 0
        self.start = time.perf_counter()
        self.totals = Counter()  # samples, tokens and padded_tokens over the whole run

    def add(self, step, counts: tuple):
        """`step`: the batch's `Step` (its summed loss and units); `counts`: its examples, real and padded tokens."""
        examples, tokens, padded_tokens = counts
        loss = step.loss.detach().float()
        self.sums[:2] += torch.stack([loss, step.units.float()])
        self.sums[2] += tokens  # a tensor on the device, or a number: neither makes the host wait
        self.nonfinite += ~torch.isfinite(loss)
        self.samples += examples
        self.padded_tokens += padded_tokens

    def nonfinite_losses(self, accelerator) -> int:
        """NaN or infinite losses so far on all ranks (a collective: call on every rank)."""
        return int(accelerator.reduce(self.nonfinite.clone(), reduction="sum").item())

    @contextmanager
    def paused(self):
        """Leave the time spent inside (evaluation, checkpointing) out of the throughput."""
        started = time.perf_counter()
        yield
        self.start += time.perf_counter() - started

    def flush(self, accelerator) -> dict:
        """Mean loss and throughput over all ranks since the last flush (a collective: call on every rank)."""
        local = torch.cat([self.sums, self.sums.new_tensor([self.samples, self.padded_tokens])])
        loss, units, tokens, samples, padded = accelerator.reduce(local, reduction="sum").tolist()
        seconds = time.perf_counter() - self.start
        self.totals.update(samples=int(samples), tokens=tokens, padded_tokens=int(padded))
        self.sums.zero_()
        self.samples = self.padded_tokens = 0
        self.start = time.perf_counter()
        return {
            "loss": loss / max(1, units),  # per unit over every rank's batches: the quantity the optimizer minimised
            "samples_per_second": samples / seconds,
            "tokens_per_second": tokens / seconds,
        }
