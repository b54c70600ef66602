"""The Running Data Recorder (``obs.rdr``): the env config ``rdr`` section, ``MS_RDR_*``, op_timeout.

- :func:`dump` writes a bundle now; :func:`recorder` is the live recorder (or None); :func:`recover` turns the rings
  of dead processes into bundles.
- The applier that starts, reconfigures and stops the recorder with the settings is
  :mod:`obs.features.rdr.feature`; the CUDA memory an out-of-memory bundle holds is
  :mod:`obs.features.rdr.cuda_memory`.
- The ring, the bundles and their readers are the ``recorder`` library; the job's run id and this process's rank
  come from :mod:`obs.runtime.job`.

Importing this package does not import torch or the ``recorder`` library's writers.
"""

from __future__ import annotations

from obs.features.rdr.feature import RdrFeature, dump, feature, recorder, recover, start_from_environment

__all__ = ["RdrFeature", "dump", "feature", "recorder", "recover", "start_from_environment"]
