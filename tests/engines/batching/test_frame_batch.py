"""FrameBatch and PaddedCache on a toy model whose frames depend on every row's KV cache and
generator: rows joining at any step, of any prompt length, get the frames they get alone; a
batched decode that fails midway is undone (the cache and the generators as they were) and run
row by row, so only the failing row fails; a failing prefill fails alone; a removed row leaves
the batch; the padded cache splits back into the rows' own caches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from omni_mesh.engines.batching.frame_batch import FrameBatch, Row
from omni_mesh.engines.batching.padded_cache import PaddedCache
from omni_mesh.engines.batching.row_sampling import row_generator

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@dataclass(eq=False)
class ToyRow(Row):
    prompt: tuple[float, ...] = ()
    frames_max: int = 6


class Toy(FrameBatch[ToyRow]):
    """One cache layer of one head of width 1: the prompt's values, then every frame's. A frame
    is the sum of the row's real (unpadded) entries plus a draw from its generator; the row
    named ``bad`` fails on its third frame, after the forward grew the cache (``fail_at``)."""

    fail_at = 2

    def prefill(self, row: ToyRow) -> Any:
        from transformers import DynamicCache

        if row.request_id == "bad-prefill":
            raise ValueError("bad prompt")
        values = torch.tensor(row.prompt, dtype=torch.float32).reshape(1, 1, -1, 1)
        cache = DynamicCache()
        cache.update(values, values, 0)
        return cache

    def decode(self, rows: list[ToyRow], cache: PaddedCache) -> None:
        ((keys, _),) = [(k, v) for k, v, *_ in cache.cache]
        sums = (keys[:, 0, :, 0] * cache.mask).sum(dim=1)
        draws = [int(torch.randint(0, 5, (1,), generator=row.generator)) for row in rows]
        frames = sums + torch.tensor(draws, dtype=torch.float32)
        cache.cache.update(frames.reshape(-1, 1, 1, 1), frames.reshape(-1, 1, 1, 1), 0)
        if any(r.request_id == "bad" and len(r.frames) == self.fail_at for r in rows):
            raise FloatingPointError("the kernel failed")
        cache.advanced()
        for row, frame in zip(rows, frames.tolist(), strict=True):
            row.frames.append(np.array([frame]))
            row.done = len(row.frames) >= row.frames_max


def row(name: str, *prompt: float, seed: int = 1) -> ToyRow:
    return ToyRow(name, row_generator(seed), prompt=prompt)


def run(batch: Toy, arrivals: dict[int, list[ToyRow]], removals: dict[int, list[ToyRow]]) -> int:
    step = 0
    while batch.busy or any(k >= step for k in arrivals):
        for r in arrivals.get(step, []):
            batch.add(r)
        batch.step()
        for r in removals.get(step, []):
            batch.remove(r)
        step += 1
    return step


def alone(prompt: tuple[float, ...], seed: int) -> list[float]:
    r = row("alone", *prompt, seed=seed)
    run(Toy(), {0: [r]}, {})
    return [float(f[0]) for f in r.frames]


def test_rows_of_any_length_joining_at_any_step_get_their_frames_alone() -> None:
    rows = [row("a", 1.0, 2.0, seed=1), row("b", 5.0, seed=2), row("c", 1.0, 1.0, 1.0, 1.0)]
    run(Toy(), {0: rows[:2], 3: rows[2:]}, {})
    for r in rows:
        assert [float(f[0]) for f in r.frames] == alone(r.prompt, int(r.generator.initial_seed()))
        assert r.done and r.error is None


def test_a_failed_batched_decode_is_undone_and_only_its_row_fails() -> None:
    good = [row("a", 1.0, 2.0, seed=1), row("b", 5.0, seed=2)]
    bad = row("bad", 3.0, 3.0, 3.0, seed=3)
    batch = Toy()
    run(batch, {0: [good[0], bad], 1: [good[1]]}, {})
    assert isinstance(bad.error, FloatingPointError) and bad.done
    assert len(bad.frames) == Toy.fail_at  # the frames it made before
    for r in good:
        assert [float(f[0]) for f in r.frames] == alone(r.prompt, int(r.generator.initial_seed()))
    assert not batch.busy and batch.cache.rows == 0


def test_a_failed_prefill_fails_alone_and_a_removed_row_leaves() -> None:
    bad = row("bad-prefill", 1.0)
    leaving = row("gone", 2.0, seed=5)
    stays = row("a", 1.0, 2.0)
    batch = Toy()
    run(batch, {0: [bad, leaving, stays]}, {2: [leaving]})
    assert isinstance(bad.error, ValueError) and bad.frames == []
    assert len(leaving.frames) == 3 and not leaving.done
    assert [float(f[0]) for f in stays.frames] == alone(stays.prompt, 1)
    batch.remove(leaving)  # already gone: a no-op


def test_the_padded_cache_left_pads_and_splits_back() -> None:
    from transformers import DynamicCache

    caches = []
    for length in (3, 1, 2):
        values = torch.arange(1.0, length + 1).reshape(1, 1, length, 1)
        cache = DynamicCache()
        cache.update(values, values + 10, 0)
        caches.append(cache)
    padded = PaddedCache()
    for cache in caches:
        padded.join(cache)
    assert padded.mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    ((keys, values),) = [(k, v) for k, v, *_ in padded.cache]
    assert keys[:, 0, :, 0].tolist() == [[1, 2, 3], [0, 0, 1], [0, 1, 2]]
    step = padded.step_mask()
    assert step is not None and step.shape == (3, 4)
    for own, split in zip(caches, padded.split(), strict=True):
        ((k0, v0),) = [(k, v) for k, v, *_ in own]
        ((k1, v1),) = [(k, v) for k, v, *_ in split]
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    padded.drop(0)  # the longest row leaves: its column of padding only goes too
    assert padded.mask.tolist() == [[0, 1], [1, 1]]
    padded.drop(1)
    assert padded.mask.tolist() == [[1]] and padded.step_mask() is None
    padded.drop(0)
    assert padded.rows == 0 and padded.cache is None
