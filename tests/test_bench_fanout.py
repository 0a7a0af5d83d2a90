"""The fan-out bench's two pieces of logic that no measurement checks: the readers' RESP
parser (a reply arrives in pieces) and the model's fit (it must give back the constants
of synthetic data). Milliseconds; numpy is in the `bench` extra: skipped without it."""

from __future__ import annotations

import pytest

from bench.fanout_readers import Incomplete, parse_reply

_REPLY = (
    b"*1\r\n*2\r\n$6\r\nstream\r\n*2\r\n"
    b"*2\r\n$3\r\n1-0\r\n*4\r\n$4\r\nkeys\r\n$5\r\n\x91\xa3a\r\n\r\n$1\r\nt\r\n$3\r\n1.5\r\n"
    b"*2\r\n$3\r\n2-0\r\n*2\r\n$1\r\nt\r\n$1\r\n2\r\n"
)


def test_a_reply_cut_anywhere_is_incomplete_until_its_last_byte() -> None:
    for cut in range(len(_REPLY)):
        with pytest.raises(Incomplete):
            parse_reply(_REPLY[:cut])
    reply, used = parse_reply(_REPLY + b"*-1\r\n")
    assert used == len(_REPLY)
    entries = reply[0][1]
    assert [e[0] for e in entries] == [b"1-0", b"2-0"]
    assert entries[0][1] == [b"keys", b"\x91\xa3a\r\n", b"t", b"1.5"]  # CRLF inside a value
    assert parse_reply(b"*-1\r\n") == (None, 5)  # XREAD timed out


def test_the_fit_gives_back_the_constants_of_synthetic_data() -> None:
    pytest.importorskip("numpy")
    from bench.fanout_model import CpuModel, fit_cpu, reads_per_s

    truth = CpuModel(d=0.003, w=100e-6, a=5e-6, u=15e-6)
    rows = []
    for n in (1, 10, 50, 100, 200):
        for e in (0.0, 10.0, 100.0, 250.0):
            x = reads_per_s(n, e)
            rows.append((e, x, truth.cpu(e, x)))
    fitted = fit_cpu(rows, per_entry=True)
    for name in ("d", "w", "a", "u"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert truth.cpu(0.0, (1 - truth.d) / truth.a) == pytest.approx(1.0)  # one core
