"""The decode CUDA graphs' buckets (common/model/cuda_graphs.py); their parity with transformers is in
test_engine_parity.py (the padded step on the CPU, and the captured graphs on a GPU)."""

import torch

from common.model.cuda_graphs import DecodeGraphs, batch_buckets, width_buckets
from common.model.loader import load_model
from common.paged_cache import PagedKVCache


def test_buckets_double_then_step_by_32_and_end_at_the_limit():
    assert batch_buckets(1) == [1]
    assert batch_buckets(10) == [1, 2, 4, 8, 10]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]
    assert width_buckets(256) == [4, 8, 16, 32, 64, 128, 256]
    assert width_buckets(3) == [3] and width_buckets(100) == [4, 8, 16, 32, 64, 100]


def test_a_step_runs_in_the_smallest_bucket_that_holds_it_and_none_past_the_gather_limit(tiny_dir):
    model = load_model(tiny_dir, torch.float32)
    text = model.text.cfg
    cache = PagedKVCache(64, 16, text.num_layers, text.num_kv_heads, text.head_dim, torch.float32, "cpu")
    token_bytes = 2 * text.num_kv_heads * text.head_dim * 4
    # 8 sequences × 16 blocks of 16 tokens at most: (8, 32) and (16, 16) are left out, (16, 8) is not
    graphs = DecodeGraphs(model.text, cache.layers, 16, 16, 1024, gather_limit_bytes=8 * 16 * 16 * token_bytes)
    assert graphs.capture() == 0.0  # the CPU captures nothing: it notes the buckets
    assert {(8, 16), (16, 8)} <= set(graphs.graphs) and not {(8, 32), (16, 16)} & set(graphs.graphs)
    assert graphs.bucket(3, 5) == (4, 8) and graphs.bucket(1, 1) == (1, 4) and graphs.bucket(9, 9) is None
    step = [torch.zeros(9, dtype=torch.long)] * 2 + [torch.zeros(9, 9, dtype=torch.int32)]
    step += [torch.ones(9, dtype=torch.int32)] + [torch.zeros(9, dtype=torch.long)] * 2
    assert graphs.run(*step) is None and graphs.replays == 0  # 9 sequences over 9 blocks: eager, in the runner
    logits = graphs.run(*(t[:3] for t in step))
    assert logits.shape == (3, text.vocab_size) and graphs.replays == 1
    torch.testing.assert_close(logits[1:], logits[:1].expand(2, -1))  # the same token, position and context
