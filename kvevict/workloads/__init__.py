"""Workloads: seeded request generators and trace readers / writers.

Generators (`generate`) build realistic multi-session traces (chat, agent, rag, single_shot,
batch and mixes such as chat-server); readers load the Mooncake, Alibaba "KVCache in the
wild", ShareGPT and kvevict's own JSONL formats. Every reader streams (``iter_*``, holding
one record at a time; ``read_*`` is ``list(iter_*(...))``), `TraceFile` re-reads a file as
often as a replay needs, and every reader raises `TraceFormatError` naming the file, line and
field of malformed input.
"""

from kvevict.workloads.formats import (
    ALIBABA_BLOCK_SIZE,
    ALIBABA_CLASSES,
    READERS,
    TraceFile,
    iter_alibaba,
    iter_jsonl,
    iter_sharegpt,
    read_alibaba,
    read_jsonl,
    read_sharegpt,
    request_from_dict,
    request_to_dict,
    trace_digest,
    write_jsonl,
)
from kvevict.workloads.generators import available_workloads, generate, workload_params
from kvevict.workloads.mooncake import (
    MOONCAKE_BLOCK_SIZE,
    IdTable,
    bundled_trace_path,
    check_block_size,
    iter_mooncake,
    read_mooncake,
    trace_block_size,
    write_mooncake,
)

__all__ = [
    "ALIBABA_BLOCK_SIZE",
    "ALIBABA_CLASSES",
    "MOONCAKE_BLOCK_SIZE",
    "READERS",
    "IdTable",
    "TraceFile",
    "available_workloads",
    "bundled_trace_path",
    "check_block_size",
    "generate",
    "iter_alibaba",
    "iter_jsonl",
    "iter_mooncake",
    "iter_sharegpt",
    "read_alibaba",
    "read_jsonl",
    "read_mooncake",
    "read_sharegpt",
    "request_from_dict",
    "request_to_dict",
    "trace_block_size",
    "trace_digest",
    "workload_params",
    "write_jsonl",
    "write_mooncake",
]
