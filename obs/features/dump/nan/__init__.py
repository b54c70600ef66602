"""The NaN/Inf check: the first module (or op) whose output, or gradient in backward, holds NaN or Inf.

The room: :mod:`.check` is the check (``NanCheck``: the hooks, one gate per tensor); :mod:`.findings` what it does
with a finding (a folder of the tensors, a FAULT, the raise of ``action="raise"``: ``NonFiniteError``);
:mod:`.device_flags` keeps CUDA tensors' gates on their device and reads them once per step, off the training
thread; :mod:`._grad_links` leaves out gradients a module's backward cannot make non-finite; :mod:`.native_check`
is the C++ module hook (``_fast_nan.cpp``).  Importing this package imports nothing.
"""
