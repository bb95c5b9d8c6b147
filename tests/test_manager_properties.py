"""A Hypothesis state machine drives the manager against a plain reference model.

After every step: `check_manager()`, the reference's lengths and statuses, page lists that fit
capacity, and the bytes of every committed position still backed by a page (each position is
stamped with its token id when committed, so a wrong page shows as a wrong token).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtool.manager import ReuseScope
from kvtool.manager.integrity import check_manager
from kvtool.types import BAD_PAGE_INDEX, KvCacheStatus
from tests.helpers.managers import make_manager

TPB = 4
PREFIXES = [[7] * 9, list(range(20, 34)), [7] * 6 + [1, 2, 3]]


def stamp(manager, cache, start, tokens):
    for group in manager.layer_groups:
        region = manager.layout.group(group.layer_group_id).regions[0]
        view = region.as_tensor(torch.int32)
        per_token = region.buffer_bytes // TPB // 4
        for p, token in enumerate(tokens, start):
            page = cache.get_page_indices(group.layer_group_id)[p // TPB]
            if page != BAD_PAGE_INDEX:
                view[page, (p % TPB) * per_token:(p % TPB) * per_token + 2] = torch.tensor([token, p])


def verify(manager, cache, sequence):
    for group in manager.layer_groups:
        region = manager.layout.group(group.layer_group_id).regions[0]
        view = region.as_tensor(torch.int32)
        per_token = region.buffer_bytes // TPB // 4
        pages = cache.get_page_indices(group.layer_group_id)
        for p in range(cache.num_committed_tokens):
            if pages[p // TPB] != BAD_PAGE_INDEX:
                found = view[pages[p // TPB], (p % TPB) * per_token:(p % TPB) * per_token + 2].tolist()
                assert found == [sequence[p], p], f"cache {cache.id} position {p}: {found}"


def lcp(a, b):
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Reference:
    def __init__(self, prompt, salt):
        self.sequence = prompt + [1000 + len(prompt) * 13 + i for i in range(40)]
        self.prompt_len = len(prompt)
        self.salt = salt
        self.status = KvCacheStatus.SUSPENDED


class ManagerMachine(RuleBasedStateMachine):
    model = "tiny"

    @initialize(num_slots=st.integers(10, 40))
    def setup(self, num_slots):
        self.manager = make_manager(self.model, TPB, num_slots=num_slots)
        self.caches = {}
        self.refs = {}
        self.committed_prefixes = []  # (salt, tokens) every committed prefix, partial leaves included
        self.next_id = 0

    def best_reference_match(self, tokens, salt):
        return max([lcp(p, tokens) for s, p in self.committed_prefixes if s == salt] + [0])

    def open_ids(self, status=None):
        return [i for i, r in self.refs.items() if r.status is not KvCacheStatus.CLOSED
                and (status is None or r.status is status)]

    @precondition(lambda self: len(self.open_ids()) < 4)
    @rule(prefix=st.sampled_from(PREFIXES), extra=st.lists(st.integers(0, 3), max_size=10),
          salt=st.sampled_from([None, "s"]), resume=st.booleans())
    def create(self, prefix, extra, salt, resume):
        prompt = prefix + extra
        ref = Reference(prompt, salt)
        scope = ReuseScope.from_cache_salt(salt)
        cache = self.manager.create_kv_cache(self.next_id, prompt[:-1], scope, expected_prompt_length=len(prompt))
        bound = self.best_reference_match(prompt[:-1], salt)
        assert cache.num_committed_tokens <= bound
        if self.model == "tiny" and self.manager.page_table.num_evictions == 0:
            assert cache.num_committed_tokens == bound
        assert cache.capacity == cache.history_length == cache.num_committed_tokens
        verify(self.manager, cache, ref.sequence)
        self.caches[self.next_id], self.refs[self.next_id] = cache, ref
        if resume:
            assert cache.resume()
            ref.status = KvCacheStatus.ACTIVE
        self.next_id += 1

    @precondition(lambda self: self.open_ids(KvCacheStatus.SUSPENDED))
    @rule(data=st.data())
    def resume(self, data):
        i = data.draw(st.sampled_from(self.open_ids(KvCacheStatus.SUSPENDED)))
        assert self.caches[i].resume()
        self.refs[i].status = KvCacheStatus.ACTIVE

    @precondition(lambda self: self.open_ids(KvCacheStatus.ACTIVE))
    @rule(data=st.data(), grow=st.integers(0, 12), raise_history=st.integers(0, 6))
    def resize(self, data, grow, raise_history):
        i = data.draw(st.sampled_from(self.open_ids(KvCacheStatus.ACTIVE)))
        cache = self.caches[i]
        capacity = min(cache.capacity + grow, len(self.refs[i].sequence))
        history = min(cache.history_length + raise_history, capacity)
        before = (cache.capacity, cache.history_length, [cache.get_page_indices(g.layer_group_id)
                                                         for g in self.manager.layer_groups])
        if not cache.resize(capacity, history):
            after = (cache.capacity, cache.history_length, [cache.get_page_indices(g.layer_group_id)
                                                            for g in self.manager.layer_groups])
            assert after == before
        else:
            assert (cache.capacity, cache.history_length) == (capacity, history)

    @precondition(lambda self: self.open_ids(KvCacheStatus.ACTIVE))
    @rule(data=st.data(), n=st.integers(1, 12))
    def commit(self, data, n):
        self.commit_tokens(data.draw(st.sampled_from(self.open_ids(KvCacheStatus.ACTIVE))), n)

    def commit_tokens(self, i, n):
        cache, ref = self.caches[i], self.refs[i]
        start = cache.num_committed_tokens
        n = min(n, cache.capacity - start)
        if n == 0:
            return
        tokens = ref.sequence[start:start + n]
        stamp(self.manager, cache, start, tokens)
        cache.commit(tokens)
        assert cache.num_committed_tokens == start + n and cache.history_length >= start + n
        committed = ref.sequence[:cache.num_committed_tokens]
        self.committed_prefixes.append((ref.salt, committed[:len(committed) // TPB * TPB]))

    @precondition(lambda self: self.open_ids(KvCacheStatus.ACTIVE))
    @rule(data=st.data(), n=st.integers(1, 12))
    def forward_pass(self, data, n):
        """What the engine does most: grow by n tokens, then commit them."""
        i = data.draw(st.sampled_from(self.open_ids(KvCacheStatus.ACTIVE)))
        cache = self.caches[i]
        if cache.resize(min(cache.capacity + n, len(self.refs[i].sequence))):
            self.commit_tokens(i, cache.capacity - cache.num_committed_tokens)

    @precondition(lambda self: self.open_ids(KvCacheStatus.ACTIVE))
    @rule(data=st.data())
    def suspend(self, data):
        i = data.draw(st.sampled_from(self.open_ids(KvCacheStatus.ACTIVE)))
        self.caches[i].suspend()
        self.refs[i].status = KvCacheStatus.SUSPENDED

    def closable(self):
        return [i for i in self.open_ids() if self.caches[i].num_committed_tokens > 0 or len(self.open_ids()) >= 4]

    @precondition(lambda self: self.closable())
    @rule(data=st.data())
    def close(self, data):
        i = data.draw(st.sampled_from(self.closable()))
        cache, ref = self.caches[i], self.refs[i]
        self.committed_prefixes.append((ref.salt, ref.sequence[:cache.num_committed_tokens]))
        cache.close()
        ref.status = KvCacheStatus.CLOSED

    @rule(prefix=st.sampled_from(PREFIXES), salt=st.sampled_from([None, "s"]))
    def match(self, prefix, salt):
        before = [p.slot for p in self.manager.page_table.droppable_pages(0)]
        found = self.manager.match(prefix, ReuseScope.from_cache_salt(salt)).num_tokens(TPB)
        assert found <= self.best_reference_match(prefix, salt)
        assert [p.slot for p in self.manager.page_table.droppable_pages(0)] == before

    @invariant()
    def consistent(self):
        if not hasattr(self, "manager"):
            return
        check_manager(self.manager)
        for i in self.open_ids():
            cache, ref = self.caches[i], self.refs[i]
            assert cache.status is ref.status
            for group in self.manager.layer_groups:
                assert len(cache.get_page_indices(group.layer_group_id)) == -(-cache.capacity // TPB)
            verify(self.manager, cache, ref.sequence)


class VswaMachine(ManagerMachine):
    model = "tiny-vswa"


_settings = settings(max_examples=60, stateful_step_count=50, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = _settings
TestVswaMachine = VswaMachine.TestCase
TestVswaMachine.settings = _settings
