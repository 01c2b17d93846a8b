"""The messages between a front end and an engine-core process (minillm/engine/core_client.py and
core_process.py), as msgspec structs encoded with msgpack.

msgspec over ZMQ rather than pickle: a typed decode of array-like structs costs a few microseconds per step at
hundreds of outputs, builds no arbitrary objects from the socket, and the payload (token ids, sampling params,
plain CoreOutputs) is plain data already (minillm/contract.py, minillm/engine/outputs.py).
"""
from __future__ import annotations

import msgspec

from minillm.engine.outputs import CoreOutput, EngineStats
from minillm.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    priority: int


class FinishRequests(msgspec.Struct, tag="finish", array_like=True):
    request_ids: list[str]
    status: str                 # a RequestStatus value: "abort" or "stop"


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Ready(msgspec.Struct, tag="ready", array_like=True):
    replica: int
    facts: bytes                # pickled EngineFacts: sent once, so pickle's generality costs nothing here


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    replica: int
    outputs: list[CoreOutput]
    stats: EngineStats
    load_tokens: int            # running + waiting tokens still to compute: the data-parallel balancer's score


class Rejected(msgspec.Struct, tag="rejected", array_like=True):
    replica: int
    request_id: str
    message: str


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """A step raised in the core; every request it held has been dropped there."""
    replica: int
    request_ids: list[str]
    message: str


ToCore = AddRequest | FinishRequests | Shutdown
FromCore = Ready | StepOutputs | Rejected | Failed

encoder = msgspec.msgpack.Encoder()
to_core = msgspec.msgpack.Decoder(ToCore)
from_core = msgspec.msgpack.Decoder(FromCore)
