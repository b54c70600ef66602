"""Print records in MindSpore's wire format: values → items → encoder → writer; reader → parse_print.

``import printsink`` does not import torch; torch tensors are converted only when printed.
"""

from printsink.encoder import CallMeta, encode_record
from printsink.reader import (PrintCall, PrintFileError, PrintFileWarning, TruncatedPrintFile, follow_print,
                              iter_print, parse_print)
from printsink.values import TensorItem, normalize
from printsink.writer import PrintWriter

__all__ = ["CallMeta", "PrintCall", "PrintFileError", "PrintFileWarning", "PrintWriter", "TensorItem",
           "TruncatedPrintFile", "encode_record", "follow_print", "iter_print", "normalize", "parse_print"]
