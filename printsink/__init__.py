"""Print records in MindSpore's wire format: values → items → encoder → writer; reader → parse_print.

``import printsink`` does not import torch; torch tensors are converted only when printed.  It imports
``obs._core.errors`` (through ``obs``) so that a damaged print file is an ``obs`` ``DamagedFileError``.
"""

import obs._core.errors  # noqa: F401 - first: obs imports printsink's modules back while it initialises
from printsink.encoder import CallMeta, encode_record
from printsink.reader import (
    NotAPrintFile,
    PrintCall,
    PrintFileError,
    PrintFileWarning,
    TruncatedPrintFile,
    follow_print,
    iter_print,
    parse_print,
)
from printsink.values import TensorItem, normalize
from printsink.writer import PrintFileFullWarning, PrintWriter

__all__ = ["CallMeta", "NotAPrintFile", "PrintCall", "PrintFileError", "PrintFileFullWarning", "PrintFileWarning",
           "PrintWriter", "TensorItem", "TruncatedPrintFile", "encode_record", "follow_print", "iter_print",
           "normalize", "parse_print"]
