"""retina_common/retry.py: the retryable codes, the pauses, and when a retry gives up."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from retina_common.retry import RETRYABLE_CODES, Backoff, rpc_with_retry, until_deadline


class Answer(grpc.RpcError):
    """A status as a gRPC client sees it (code and details), without a server."""

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code.name)
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


def answering(*answers: grpc.StatusCode | str) -> tuple[list[int], object]:
    """A call that raises each code in turn, then returns the string; and its call count."""
    calls = [0]

    def call() -> str:
        answer = answers[min(calls[0], len(answers) - 1)]
        calls[0] += 1
        if isinstance(answer, grpc.StatusCode):
            raise Answer(answer)
        return answer
    return calls, call


def test_the_retryable_codes_are_the_outcome_unknown_ones() -> None:
    assert set(RETRYABLE_CODES) == {grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED,
                                    grpc.StatusCode.CANCELLED}


def test_backoff_doubles_to_its_cap_and_stops_early() -> None:
    backoff = Backoff(0.001, 0.004)
    pauses = []
    for _ in range(4):
        pauses.append(backoff.next_s)
        assert backoff.pause() is False
    assert pauses == [0.001, 0.002, 0.004, 0.004]
    stop = threading.Event()
    stop.set()
    started = time.monotonic()
    assert Backoff(30, 60).pause(stop) is True
    assert time.monotonic() - started < 5


def test_rpc_with_retry_sends_again_only_on_retryable_codes() -> None:
    calls, call = answering(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, "ok")
    assert rpc_with_retry(call, attempts=3, first_pause_s=0.001) == "ok" and calls[0] == 3
    calls, call = answering(grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(Answer):
        rpc_with_retry(call, attempts=3, first_pause_s=0.001)
    assert calls[0] == 3
    calls, call = answering(grpc.StatusCode.FAILED_PRECONDITION, "ok")
    with pytest.raises(Answer):
        rpc_with_retry(call, attempts=3, first_pause_s=0.001)
    assert calls[0] == 1
    calls, call = answering(grpc.StatusCode.DEADLINE_EXCEEDED, "ok")
    with pytest.raises(Answer):  # a narrower set: a lost answer is not sent again
        rpc_with_retry(call, attempts=3, retry_on=(grpc.StatusCode.UNAVAILABLE,),
                       first_pause_s=0.001)
    assert calls[0] == 1


def test_until_deadline_retries_transient_errors_within_the_deadline() -> None:
    calls, call = answering(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, "ok")
    retried: list[BaseException] = []
    assert until_deadline(call, transient=(Answer,), deadline_s=5, on_retry=retried.append,
                          first_pause_s=0.001) == "ok"
    assert calls[0] == 3 and len(retried) == 2
    calls, call = answering(grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(Answer):  # the next pause would pass the deadline: give up now
        until_deadline(call, transient=(Answer,), deadline_s=0.05, on_retry=retried.append,
                       first_pause_s=0.1)
    assert calls[0] == 1
