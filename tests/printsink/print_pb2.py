"""Message classes for MindSpore's ``print.proto`` (exact), built the way generated ``print_pb2`` is.

``Print`` is MindSpore's message as it ships; ``ObsPrint`` is the same message with obs's call
metadata declared as field 15, to check what MindSpore's parser keeps as an unknown field.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message_factory import GetMessageClass

F = descriptor_pb2.FieldDescriptorProto


def _field(name, number, ftype, label=F.LABEL_OPTIONAL, type_name=None, oneof=None):
    field = F(name=name, number=number, type=ftype, label=label)
    if type_name:
        field.type_name = type_name
    if oneof is not None:
        field.oneof_index = oneof
    return field


def _build(with_meta: bool):
    fdp = descriptor_pb2.FileDescriptorProto(name="print.proto" if not with_meta else "obs_print.proto",
                                             package="mindspore.prntpb" if not with_meta else "obs.prntpb",
                                             syntax="proto2")
    pkg = fdp.package
    tensor = fdp.message_type.add(name="TensorProto")
    tensor.field.extend([
        _field("dims", 1, F.TYPE_INT64, F.LABEL_REPEATED),
        _field("tensor_type", 2, F.TYPE_STRING, F.LABEL_REQUIRED),
        _field("tensor_content", 3, F.TYPE_BYTES, F.LABEL_REQUIRED),
    ])
    printmsg = fdp.message_type.add(name="Print")
    value = printmsg.nested_type.add(name="Value")
    value.oneof_decl.add(name="value")
    value.field.extend([
        _field("desc", 1, F.TYPE_STRING, oneof=0),
        _field("tensor", 2, F.TYPE_MESSAGE, type_name=f".{pkg}.TensorProto", oneof=0),
    ])
    printmsg.field.append(_field("value", 1, F.TYPE_MESSAGE, F.LABEL_REPEATED, f".{pkg}.Print.Value"))
    if with_meta:
        meta = fdp.message_type.add(name="CallMeta")
        for number, name in enumerate(("seq", "time_ns", "step", "rank", "pid"), start=1):
            meta.field.append(_field(name, number, F.TYPE_FIXED64 if name == "time_ns" else F.TYPE_UINT64))
        meta.field.append(_field("source", 6, F.TYPE_STRING))
        meta.field.append(_field("n_values", 7, F.TYPE_UINT64))
        printmsg.field.append(_field("obs_meta", 15, F.TYPE_MESSAGE, type_name=f".{pkg}.CallMeta"))
    pool = descriptor_pool.DescriptorPool()
    file = pool.Add(fdp)
    return (GetMessageClass(file.message_types_by_name["Print"]),
            GetMessageClass(file.message_types_by_name["TensorProto"]))


Print, TensorProto = _build(with_meta=False)
ObsPrint, _ = _build(with_meta=True)
assert Print.DESCRIPTOR.full_name == "mindspore.prntpb.Print"
