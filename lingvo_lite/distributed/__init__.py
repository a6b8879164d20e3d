"""The cluster: its tasks, their process group, collectives across devices and tasks, placement.

One owner of the cluster concept. `cluster_spec` parses TF_CONFIG once, strictly (`Cluster`,
`parse_tf_config`), and defines the job name, the errors that mean a lost peer and the line that
names one; `process_group` starts a task's collectives and TensorFlow's coordination service;
`heartbeats` is what TensorFlow does not do for us (see its docstring); `collectives`,
`replica_means` and `cross_process` sum and average over replicas and tasks; `placement` and
`tpu` map a mesh's cells to devices. The pipeline runtime, the trainer and the Keras adapter
import this package; it imports none of them.

>>> from lingvo_lite import distributed
>>> distributed.parse_tf_config({}) is None
True

Imported on first use, like the names of `lingvo_lite`.
"""

from lingvo_lite.core import _lazy

_EXPORTS = {
    "Cluster": "lingvo_lite.distributed.cluster_spec",
    "ClusterSpecError": "lingvo_lite.distributed.cluster_spec",
    "JOB": "lingvo_lite.distributed.cluster_spec",
    "parse_tf_config": "lingvo_lite.distributed.cluster_spec",
    "initialize": "lingvo_lite.distributed.process_group",
    "from_tf_config": "lingvo_lite.distributed.process_group",
    "current": "lingvo_lite.distributed.process_group",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = _lazy.exporter(__name__, _EXPORTS, globals())
