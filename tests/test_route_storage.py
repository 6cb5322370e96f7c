"""R3 route storage: GroupRoutes holds the prompt's routes once and each response's once, in the id dtype, and its
views (padded, sequence windows) equal the full per-response construction they replace."""

import torch

from longstraw.routing import ExpertLayout, GroupRoutes, route_status

LAYOUT = ExpertLayout(num_layers=3, num_experts=8, top_k=2)


def _ids(n: int, gen: torch.Generator, layout: ExpertLayout = LAYOUT) -> torch.Tensor:
    """[n, L, k] uint8 routes, k distinct experts per row."""
    scores = torch.rand(n, layout.num_layers, layout.num_experts, generator=gen)
    return scores.topk(layout.top_k, dim=-1).indices.to(layout.route_dtype)


def _held_bytes(routes) -> int:
    """nbytes of every tensor the object holds (fields, and tensors inside list fields)."""
    held = 0
    for value in vars(routes).values():
        for x in value if isinstance(value, list) else [value]:
            if isinstance(x, torch.Tensor):
                held += x.nbytes
    return held


def _full_construction(prompt, routes_G, num_prompt, lengths, layout, replay):
    """The per-response construction GroupRoutes used to store: statuses, [G, S, L, k] int64 routes with the
    prompt copied into every row, ok [G, S], and the sequence view's prompt rows (taken from the first row whose
    prompt replays)."""
    seq_len = num_prompt + max(lengths) - 1
    routes_G_S = torch.zeros(len(lengths), seq_len, layout.num_layers, layout.top_k, dtype=torch.long)
    ok_G_S = torch.zeros(len(lengths), seq_len, dtype=torch.bool)
    statuses = []
    for i, n in enumerate(lengths):
        full = None
        if prompt is not None and routes_G[i] is not None:
            try:
                full = torch.cat([prompt, routes_G[i]])
            except (RuntimeError, TypeError):
                full = None
        status_S = route_status(full, num_prompt - 1 + n, layout)
        statuses.append(status_S[num_prompt - 1 :])
        if replay and full is not None:
            ok = status_S == 0
            routes_G_S[i, : len(ok)][ok] = full[ok].long()
            ok_G_S[i, : len(ok)] = ok
    p1 = num_prompt - 1
    source = int(ok_G_S[:, :p1].any(1).float().argmax())
    return statuses, routes_G_S, ok_G_S, routes_G_S[source, :p1], ok_G_S[source, :p1]


def _group(gen: torch.Generator, num_prompt: int, lengths: list[int]):
    """Prompt and responses where response 1 has an out-of-range and a duplicate row, and response 2 has the wrong
    number of MoE layers (its record does not join the prompt's: the whole record fails, prompt rows included)."""
    prompt = _ids(num_prompt - 1, gen)
    prompt[4, 1, 0] = 200  # out of range in the prompt: no response replays position 4
    routes_G = [_ids(n, gen) for n in lengths]
    routes_G[1][0, 2, 1] = 9
    routes_G[1][2, 0] = torch.tensor([3, 3], dtype=torch.uint8)
    routes_G[2] = routes_G[2][:, :2]
    return prompt, routes_G


def test_group_routes_hold_the_prompt_once_and_the_responses_in_uint8():
    """Prompt of 4095 positions, 8 responses of 1..64 tokens, 4 MoE layers, top-2 of 64 experts. GroupRoutes
    stored int64 [G, P+R_max-1, L, k] with the prompt copied into every response row (8 x 4159 x 8 x 8 B = 2.1 MB
    here, 409 MB at P=16384, L=48, k=8); it must hold one uint8 prompt copy, each response once, the ok masks and
    the int64 statuses, nothing more."""
    layout = ExpertLayout(num_layers=4, num_experts=64, top_k=2)
    gen = torch.Generator().manual_seed(0)
    num_prompt, lengths = 4096, [1, 7, 64, 33, 2, 64, 5, 16]
    prompt = _ids(num_prompt - 1, gen, layout)
    routes_G = [_ids(n, gen, layout) for n in lengths]
    routes = GroupRoutes.build(prompt, routes_G, num_prompt, lengths, layout, replay=True)
    rows = num_prompt - 1 + sum(lengths)
    route_bytes = rows * layout.num_layers * layout.top_k  # uint8: one byte per id
    expected = route_bytes + rows + 8 * sum(lengths)  # + ok masks (bool) + statuses (int64)
    assert _held_bytes(routes) == expected
    assert routes.nbytes == expected
    assert routes.prompt_routes_P1_L_K.dtype == routes.routes_N_L_K.dtype == torch.uint8


def test_route_ids_past_256_experts_are_stored_as_int16():
    layout = ExpertLayout(num_layers=2, num_experts=300, top_k=2)
    gen = torch.Generator().manual_seed(1)
    prompt, response = _ids(5, gen, layout), _ids(3, gen, layout)
    response[0, 0] = torch.tensor([299, 256], dtype=torch.int16)
    routes = GroupRoutes.build(prompt, [response], 6, [3], layout, replay=True)
    assert routes.routes_N_L_K.dtype == torch.int16
    window, ok = routes.sequence().window(5, 1)
    assert window[0, 0].tolist() == [299, 256] and bool(ok.all())


def test_statuses_and_padded_view_equal_the_full_construction():
    """Statuses, the naive step's padded [G*S] routes and ok, and the native-row lookup are those of the full
    per-response construction, R3 on and off, with out-of-range, duplicate and wrong-layer records in the group."""
    gen = torch.Generator().manual_seed(2)
    num_prompt, lengths = 23, [5, 9, 4, 1]
    prompt, routes_G = _group(gen, num_prompt, lengths)
    for replay in (True, False):
        routes = GroupRoutes.build(prompt, routes_G, num_prompt, lengths, LAYOUT, replay=replay)
        statuses, routes_G_S, ok_G_S, _, _ = _full_construction(prompt, routes_G, num_prompt, lengths, LAYOUT, replay)
        for got, want in zip(routes.status_G, statuses, strict=True):
            assert torch.equal(got, want)
        padded_T_L_K, ok_T = routes.padded()
        assert padded_T_L_K.dtype == torch.long
        assert torch.equal(padded_T_L_K, routes_G_S.flatten(0, 1)) and torch.equal(ok_T, ok_G_S.flatten())
        for i in range(len(lengths)):
            assert torch.equal(routes.response_rows(padded_T_L_K, i), routes_G_S[i, num_prompt - 1 :][: lengths[i]])
    assert int(statuses[1][0]) == 1 + 3 and int(statuses[1][2]) == 1 + 4  # out_of_range, duplicate
    assert bool((statuses[2] == 1).all())  # its 2 layers do not join the prompt's 3: route_missing, whole record


def test_window_equals_the_full_sequence_slice_over_any_window():
    """window(start, n) of every response equals the slice of the full sequence (prompt rows + response rows, int64)
    over random windows and the edge ones: empty, inside the prompt, inside the response, straddling the
    prompt/response boundary, the whole sequence, the last position."""
    gen = torch.Generator().manual_seed(3)
    num_prompt, lengths = 37, [5, 9, 12, 1]
    prompt, routes_G = _group(gen, num_prompt, lengths)
    routes = GroupRoutes.build(prompt, routes_G, num_prompt, lengths, LAYOUT, replay=True)
    _, routes_G_S, ok_G_S, prompt_S, prompt_ok_S = _full_construction(
        prompt, routes_G, num_prompt, lengths, LAYOUT, True
    )
    sequence = routes.sequence()
    p1 = num_prompt - 1
    for i, n_resp in enumerate(lengths):
        sequence.current = i
        full_S = torch.cat([prompt_S, routes_G_S[i, p1 : p1 + n_resp]])
        full_ok_S = torch.cat([prompt_ok_S, ok_G_S[i, p1 : p1 + n_resp]])
        total = p1 + n_resp
        windows = [(0, 0), (3, 7), (0, p1), (p1, n_resp), (p1 - 2, 3), (p1 - 1, n_resp + 1), (0, total)]
        windows += [(total - 1, 1)]
        for _ in range(20):
            start = int(torch.randint(total, (1,), generator=gen))
            windows.append((start, int(torch.randint(total - start + 1, (1,), generator=gen))))
        for start, n in windows:
            window_T_L_K, ok_T = sequence.window(start, n)
            assert window_T_L_K.dtype == torch.long and window_T_L_K.shape == (n, LAYOUT.num_layers, LAYOUT.top_k)
            assert torch.equal(window_T_L_K, full_S[start : start + n]), (i, start, n)
            assert torch.equal(ok_T, full_ok_S[start : start + n]), (i, start, n)


def test_sequence_views_share_the_stored_rows_without_copies():
    gen = torch.Generator().manual_seed(4)
    prompt, routes_G = _ids(10, gen), [_ids(n, gen) for n in (3, 4)]
    routes = GroupRoutes.build(prompt, routes_G, 11, [3, 4], LAYOUT, replay=True)
    sequence = routes.sequence()
    assert sequence.prompt_routes_S_L_K.data_ptr() == routes.prompt_routes_P1_L_K.data_ptr()
    assert all(r.untyped_storage().data_ptr() == routes.routes_N_L_K.data_ptr() for r, _ in sequence.responses)


def test_shifted_record_whose_prompt_and_response_lengths_do_not_split_at_p_minus_1_is_missing():
    """A prompt record one row too long and a response record one row short add up to P-1+R rows. Joined, the
    record passed the length check and replayed the prompt's extra row at the response's first position; stored
    apart, it is a record of the wrong length: route_missing, nothing replayed."""
    gen = torch.Generator().manual_seed(5)
    prompt, response = _ids(11, gen), _ids(3, gen)
    routes = GroupRoutes.build(prompt, [response], 11, [4], LAYOUT, replay=True)
    assert routes.status_G[0].tolist() == [1, 1, 1, 1]
    assert not bool(routes.ok_N.any()) and not bool(routes.prompt_ok_P1.any())
