"""TokenNotes writes a forward's rows into the token table: the tokens known, -1 past them; a row
noted again for the same request gets only its new positions when the table is the engine's alone."""

from __future__ import annotations

import torch

from pytest_kvcanary.reference_engine.token_notes import TokenNotes


def table() -> torch.Tensor:
    return torch.full((3, 8), -1, dtype=torch.int64)


def test_a_row_holds_its_known_tokens_and_minus_one_past_them_whatever_it_held():
    t = table()
    t[1] = 99
    notes = TokenNotes(t, incremental=True)
    notes.note([1, 2], ["a", "b"], [[5, 6, 7], [8]], [3, 1])
    assert t[1].tolist() == [5, 6, 7, -1, -1, -1, -1, -1] and t[2].tolist() == [8] + [-1] * 7
    notes.note([1], ["c"], [[4]], [1])  # another request takes row 1: written whole
    assert t[1].tolist() == [4] + [-1] * 7


def test_the_same_request_again_gets_only_its_new_positions_unless_it_holds_fewer_tokens():
    t = table()
    notes = TokenNotes(t, incremental=True)
    notes.note([0], ["a"], [[5, 6]], [2])
    t[0, 0] = 42  # a position the request already held: an incremental note leaves it be
    notes.note([0], ["a"], [[5, 6, 7]], [3])
    assert t[0].tolist() == [42, 6, 7] + [-1] * 5
    notes.note([0], ["a"], [[5]], [1])  # fewer tokens (re-prefilled): whole again
    assert t[0].tolist() == [5] + [-1] * 7


def test_without_incremental_notes_every_row_is_written_whole_and_minus_one_starts_at_its_end():
    t = table()
    notes = TokenNotes(t, incremental=False)
    notes.note([0], ["a"], [[5, 6]], [2])
    t[0, 0], t[0, 2] = 42, 9  # position 2: the device wrote the next input there (async scheduling)
    notes.note([0], ["a"], [[5, 6]], [3])
    assert t[0].tolist() == [5, 6, 9] + [-1] * 5


def test_clear_forgets_what_rows_held():
    t = table()
    notes = TokenNotes(t, incremental=True)
    notes.note([0], ["a"], [[5, 6]], [2])
    t.fill_(-1)
    notes.clear()
    notes.note([0], ["a"], [[5, 6, 7]], [3])
    assert t[0].tolist() == [5, 6, 7] + [-1] * 5
