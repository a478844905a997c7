"""One process of a two-process launcher run; run by tests/test_multihost.py.

  python tests/_multihost_worker.py <launcher dir> <scratch> <process id> <coordinator port>
      process 0 or 1 of a jax.distributed job on localhost, each with the local devices
      XLA_FLAGS gives it, decoding the tiny checkpoints under <launcher dir>/{target,draft}
      (tests/_sharded_worker.py's LAUNCHER_CONFIG) on a 2 x 2 ('data', 'model') mesh
      over all of them into scratch/process_<id> (only process 0 may write there)

Prints one JSON object on the last line of stdout: the summary and what this process
saw of the job.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import _sharded_worker  # noqa: E402  pylint: disable=g-import-not-at-top


def main(launcher_dir: str, scratch: str, role: str, port: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  summary = _sharded_worker.run_launcher(launcher_dir, f'{scratch}/process_{role}', [
      "include 'gin/partitioning/data_parallel.gin'",
      "include 'gin/partitioning/multihost.gin'",
      'jaxspec.PartitioningConfig.num_partitions = 2',
      f"jaxspec.PartitioningConfig.coordinator_address = 'localhost:{port}'",
      'jaxspec.PartitioningConfig.num_processes = 2',
      f'jaxspec.PartitioningConfig.process_id = {int(role)}'])
  print(json.dumps({'summary': summary, 'process_index': jax.process_index(),
                    'process_count': jax.process_count(),
                    'device_count': jax.device_count(),
                    'local_device_count': jax.local_device_count()}))


if __name__ == '__main__':
  main(*sys.argv[1:])
