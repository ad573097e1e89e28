"""A front worker's call whose client went away is called off in the serving process too
(issue 47, item 3): the worker's ``Link`` sends ``Cancel`` with the call's id when the task
awaiting its reply is cancelled (the lean gRPC server cancels a call's task when its stream
is reset or its connection closes), and the serving process cancels the task running it
(appliance/fronts/serving.py ``_cancellable``). A call answered normally sends no Cancel."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from appliance.fronts import messages as m
from appliance.fronts.link import Link


class Recorder:
    """The channel's face: what the link sends, kept."""

    def __init__(self) -> None:
        self.sent: list[msgspec.Struct] = []

    def send(self, message: msgspec.Struct) -> None:
        self.sent.append(message)

    def send_threadsafe(self, message: msgspec.Struct) -> None:
        self.sent.append(message)


def test_a_call_cancelled_while_it_waits_sends_cancel_with_its_id() -> None:
    channel = Recorder()

    async def abandoned() -> int:
        link = Link(lambda message: None)
        link.attach(asyncio.get_running_loop(), channel)
        request = m.Resolve(link.next_id(), "mlp", None, None)
        task = asyncio.create_task(link.call(request))
        while not channel.sent:  # sent on the task's first step
            await asyncio.sleep(0)
        task.cancel()  # its client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        return request.id

    ident = asyncio.run(abandoned())
    assert [type(message) for message in channel.sent] == [m.Resolve, m.Cancel]
    cancel = channel.sent[1]
    assert isinstance(cancel, m.Cancel) and cancel.stream == ident


def test_a_call_answered_sends_no_cancel() -> None:
    channel = Recorder()

    async def answered() -> object:
        link = Link(lambda message: None)
        link.attach(asyncio.get_running_loop(), channel)
        request = m.Resolve(link.next_id(), "mlp", None, None)
        task = asyncio.create_task(link.call(request))
        while not channel.sent:
            await asyncio.sleep(0)
        link.on_message(None, m.failed(request.id, ValueError("no such model")))
        return await task

    reply = asyncio.run(answered())
    assert isinstance(reply, m.Failed)
    assert [type(message) for message in channel.sent] == [m.Resolve]
