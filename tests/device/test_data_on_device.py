"""The data path with the state on a GPU: collation, the host-to-device copy, prefetching, the run's batches."""

import dataclasses

import numpy as np
from simulated_cuda import simulated_cuda

from ember import data
from ember.data import prefetch, to_torch
from ember.launch import build
from ember.launch.run_config import get_config


def test_collate_moves_every_field(cuda):
    batch = to_torch({"inputs": np.zeros((2, 3), np.int32), "segment_ids": np.ones((2, 3), np.int32), "n": 3},
                     device=cuda)
    assert all(v.is_cuda for k, v in batch.items() if k != "n")


def test_prefetch_copies_to_the_device_in_its_thread(cuda):
    def collate_on_gpu(b):  # the simulation is per thread: the prefetch thread enters it too
        with simulated_cuda():
            return to_torch(b, device=cuda)

    with prefetch(iter([{"inputs": np.arange(6).reshape(2, 3)}] * 2), transform=collate_on_gpu) as batches:
        assert all(b["inputs"].is_cuda for b in batches)


def test_the_runs_batches_land_on_the_device(cuda):
    cfg = get_config("llama3_tiny")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_bytes=20000, batch_size=2, seq_len=16))
    tokenizer = build.build_tokenizer(cfg, build.build_model(cfg))
    batch = next(iter(data.build_batches(cfg.data, tokenizer=tokenizer, device=cuda)))
    assert all(v.is_cuda for v in batch.values())
