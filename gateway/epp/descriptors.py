"""Envoy's ext_proc API as a protobuf descriptor set, for the native front end's build.

``python -m gateway.epp.descriptors OUT`` writes the ``FileDescriptorSet`` of
``envoy/service/ext_proc/v3/external_processor.proto`` and everything it imports, taken from
``xds-protos`` (the messages the Python front end uses), and prints the files protoc should
generate (protobuf's own well-known types left out: libprotobuf has them).
``scripts/setup_native.sh`` feeds it to ``protoc --descriptor_set_in``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from envoy.service.ext_proc.v3 import external_processor_pb2
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor


def descriptor_set(root: FileDescriptor) -> descriptor_pb2.FileDescriptorSet:
    """``root`` and its imports, each after what it imports."""
    seen: dict[str, descriptor_pb2.FileDescriptorProto] = {}

    def add(fd: FileDescriptor) -> None:
        if fd.name in seen:
            return
        for dep in fd.dependencies:
            add(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)
        seen[fd.name] = proto

    add(root)
    return descriptor_pb2.FileDescriptorSet(file=list(seen.values()))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m gateway.epp.descriptors OUT", file=sys.stderr)
        return 2
    fds = descriptor_set(external_processor_pb2.DESCRIPTOR)
    Path(argv[0]).write_bytes(fds.SerializeToString())
    print(" ".join(f.name for f in fds.file if not f.name.startswith("google/protobuf/")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
