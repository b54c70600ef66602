"""The statistic dump: ``statistic.csv``, one row per tensor an op read or wrote, in MindSpore's columns.

The room: :mod:`.statistic_csv` records a step's rows as ops return and writes the file's text at the step's end;
:mod:`.tensor_stats` computes one tensor's statistics (the C pass ``_stats.c``, with the vendored ``ryu/`` for
numbers printed as Python does, else torch); :mod:`.native_rows` is the C++ recorder of plain CPU tensors' rows
(``_fast_rows.cpp``); :mod:`.device_stats` keeps CUDA tensors' statistics on their device until the step's end;
:mod:`.graph_rows` names the rows of Inductor-compiled graphs, which compute their statistics themselves;
:mod:`.columns` is the file's header, which the pure reader shares.  Importing this package imports nothing.
"""
