import pytest

from common.block_pool import BlockPool, NoFreeBlocksError, chain_hashes
from common.kv_manager import ImageBlockManager, KVBlockManager
from common.request import ImageInput, Request, Stage
from common.sampling import SamplingParams


def make_request(rid="r", prompt=20, max_tokens=5, images=0, tokens_per_image=4):
    ids = list(range(10, 10 + prompt))
    imgs = [ImageInput(None, tokens_per_image, f"img{i}") for i in range(images)]
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens), imgs)


def test_a_fresh_pool_hands_out_lowest_ids_first_and_a_freed_block_comes_back_before_unused_ones():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    pool.free([1])
    assert pool.num_free == 2
    assert pool.allocate(2) == [1, 5]
    assert not pool.can_allocate(1)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free([0, 2, 3, 4, 5, 1])
    assert pool.num_free == 6


def test_freed_blocks_come_back_most_recent_first_in_the_order_they_were_held():
    pool = BlockPool(8)
    first, second = pool.allocate(3), pool.allocate(2)
    assert (first, second) == ([0, 1, 2], [3, 4])
    pool.free(first)
    pool.free(second)  # freed last: handed out first, in its own order, then the earlier request's
    assert pool.allocate(4) == [3, 4, 0, 1]
    assert pool.allocate(2) == [2, 5]


def test_a_request_after_request_load_keeps_reusing_the_same_few_blocks():
    """The working set stays as small as the most blocks in use at once: memory the process already faulted in,
    warm in the caches (cycling through the whole pool would commit every block of it, page by page)."""
    pool = BlockPool(100)
    seen = set()
    for n in [3, 5, 2, 4, 5, 1] * 20:
        blocks = pool.allocate(n)
        seen.update(blocks)
        pool.free(blocks)
    assert seen == set(range(5))
    assert pool.num_free == 100


def test_blocks_without_a_hash_are_used_before_a_cached_one_is_evicted():
    pool = BlockPool(4)
    cached, plain = pool.allocate(2), pool.allocate(1)
    pool.set_hash(cached[0], 11)
    pool.set_hash(cached[1], 22)
    pool.free(cached)
    pool.free(plain)
    assert pool.allocate(2) == [plain[0], 3]  # no cached block touched
    assert pool.lookup(11) == cached[0] and pool.lookup(22) == cached[1]
    assert pool.allocate(1) == [cached[0]]  # then the least recently freed cached one
    assert pool.lookup(11) is None and pool.lookup(22) == cached[1]


def test_a_block_freed_too_often_raises_and_the_ones_before_it_are_free():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([a, b, b])
    assert pool.num_free == 3 and pool.allocate(3) == [a, b, 2]


def test_shared_blocks_return_only_when_the_last_reference_is_dropped():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.share(blocks)
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    pool.free(blocks)
    assert pool.num_free == 2
    pool.free(blocks)
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([0])


def test_cached_free_block_is_found_revived_and_forgotten_when_reused():
    pool = BlockPool(3)
    [a] = pool.allocate(1)
    pool.set_hash(a, 1234)
    pool.free([a])
    assert pool.lookup(1234) == a and pool.num_free == 3
    pool.share([a])  # revive from the free list
    assert pool.num_free == 2 and pool.ref_count(a) == 1
    pool.free([a])
    assert pool.allocate(3) == [1, 2, 0]  # a holds a hash: every block without one goes first
    assert pool.lookup(1234) is None


def test_block_hashes_are_a_blake2b_chain_not_pythons_hash():
    """A client must not be able to make a prompt whose blocks hash like another's: the cache would serve it that
    prompt's KV. Python's hash() of a tuple of ints can be made to collide; a 128-bit BLAKE2b chain cannot."""
    import hashlib
    from array import array

    tokens, key = list(range(100, 132)), 2**127 + 5
    first = hashlib.blake2b(bytes(16) + array("q", tokens[:16]).tobytes(), digest_size=16).digest()
    second = hashlib.blake2b(
        first + array("q", tokens[16:]).tobytes() + key.to_bytes(16, "little"), digest_size=16
    ).digest()
    assert chain_hashes(tokens, 16, [(20, key)]) == [int.from_bytes(first, "little"), int.from_bytes(second, "little")]
    assert max(chain_hashes(list(range(4000)), 16)) >= 2**64  # the whole 128 bits are the key


def test_chain_hashes_cover_full_blocks_and_depend_on_the_prefix():
    a = chain_hashes(list(range(40)), 16)
    b = chain_hashes([99] + list(range(1, 40)), 16)
    assert len(a) == 2
    assert a[0] != b[0] and a[1] != b[1]
    assert chain_hashes(list(range(40)), 16) == a
    marked = chain_hashes(list(range(40)), 16, [(20, 5)])  # a key mixed in at position 20: block 1 and on
    assert marked[0] == a[0] and marked[1] != a[1]
    assert marked[1] != chain_hashes(list(range(40)), 16, [(20, 6)])[1]  # another key there: another block


def test_kv_manager_worst_case_reserves_prompt_plus_max_tokens():
    kv = KVBlockManager(num_blocks=5, block_size=8, worst_case=True)
    req = make_request(prompt=20, max_tokens=5)  # 25 tokens → 4 blocks
    assert kv.can_allocate(req)
    assert kv.allocate(req) == 0
    assert req.block_table == [0, 1, 2, 3]
    assert not kv.can_allocate(make_request("s", prompt=8, max_tokens=1))  # 9 tokens need 2 blocks, 1 free
    req.output_token_ids = [7] * 5
    assert kv.blocks_to_grow(req) == 0  # it never grows
    kv.free(req)
    assert req.block_table == [] and kv.pool.num_free == 5


def test_kv_manager_on_demand_admits_the_prompt_and_its_first_token_then_grows_a_block_at_a_time():
    kv = KVBlockManager(num_blocks=5, block_size=8)
    req = make_request(prompt=15, max_tokens=30)  # 15 + the first sampled token's slot: 2 blocks
    assert kv.allocate(req) == 0
    assert req.block_table == [0, 1]
    req.output_token_ids = [7]  # 16 tokens: the next decode computes the 16th, its slot is there
    assert kv.blocks_to_grow(req) == 0
    req.output_token_ids = [7, 8]  # 17 tokens: a third block
    assert kv.blocks_to_grow(req) == 1 and kv.can_grow(req)
    kv.grow(req)
    assert req.block_table == [0, 1, 2]
    other = make_request("s", prompt=15, max_tokens=1)
    kv.allocate(other)
    assert other.block_table == [3, 4]
    req.output_token_ids = [7] * 10  # 25 tokens: a fourth block, none free
    assert kv.blocks_to_grow(req) == 1 and not kv.can_grow(req)
    kv.free(other)
    kv.grow(req)
    assert req.block_table == [0, 1, 2, 3]  # freed blocks are reused in the order they were freed
    kv.free(req)
    assert kv.pool.num_free == 5


def test_kv_manager_a_prefill_only_request_takes_its_prompt_and_a_preempted_one_its_output_too():
    kv = KVBlockManager(num_blocks=8, block_size=8, worst_case=True)
    prefill_only = Request("p", list(range(10, 30)), SamplingParams(max_tokens=50), last_stage=Stage.PREFILL)
    kv.allocate(prefill_only)
    assert prefill_only.block_table == [0, 1, 2]  # 20 prompt tokens; its max_tokens decode elsewhere
    kv = KVBlockManager(num_blocks=8, block_size=8)
    preempted = make_request(prompt=20, max_tokens=50)
    preempted.output_token_ids, preempted.recompute_outputs = [7] * 12, 12
    kv.allocate(preempted)
    assert preempted.num_prefill_tokens == 32 and preempted.block_table == [0, 1, 2, 3, 4]  # 32 + 1 → 5 blocks


def test_prefix_caching_shares_full_blocks_but_never_the_last_prompt_token():
    kv = KVBlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_request("a", prompt=12, max_tokens=4)
    kv.allocate(first)
    assert first.block_table == [0, 1, 2, 3]
    first.num_computed_tokens = 12
    kv.commit_prompt(first)
    second = make_request("b", prompt=12, max_tokens=4)
    assert kv.allocate(second) == 8  # blocks 0, 1 shared; block 2 holds the last prompt token: recomputed
    assert second.block_table == [0, 1, 4, 5]
    assert kv.pool.ref_count(0) == 2
    other_image = make_request("c", prompt=12, max_tokens=4, images=1)
    other_image.prompt_token_ids[:4] = [7] * 4
    assert kv.allocate(other_image) == 0
    for r in (first, second, other_image):
        kv.free(r)
    assert kv.pool.num_free == 10


def test_image_manager_allocates_for_all_image_tokens():
    images = ImageBlockManager(num_blocks=4, block_size=3)
    req = make_request(images=2, tokens_per_image=4)  # 8 image tokens → 3 blocks
    images.allocate(req)
    assert req.image_block_table == [0, 1, 2]
    assert not images.can_allocate(make_request("s", images=1, tokens_per_image=4))
    images.free(req)
    assert images.pool.num_free == 4


def test_a_salt_changes_every_block_hash_and_the_same_salt_keeps_them():
    tokens = list(range(50))
    plain, a, b = chain_hashes(tokens, 16), chain_hashes(tokens, 16, salt="a"), chain_hashes(tokens, 16, salt="b")
    assert len(plain) == len(a) == len(b) == 3
    assert not set(plain) & set(a) and not set(a) & set(b)
    assert chain_hashes(tokens, 16, salt="a") == a
