"""The classic baselines a reader expects, as residency policies over a prefix cache.

| name | class | source |
|---|---|---|
| ``s3fifo`` | `S3FIFO` | Yang et al., SOSP'23 |
| ``arc`` | `ARC` | Megiddo and Modha, FAST'03 |
| ``slru`` | `SLRU` | Karedla, Love and Wherry, IEEE Computer 1994 |
| ``2q`` | `TwoQ` | Johnson and Shasha, VLDB'94 |
| ``gdsf`` | `GDSF` | Cherkasova, HP Labs HPL-98-69R1, 1998 |

Full titles and the defaults' sources are in each module's docstring; the adaptation and the
measurements in ``docs/policies/classic.md``. Each policy keeps its paper's queues over every
resident block and evicts the first *candidate* (cached leaf no sequence uses) in the order the
paper evicts in; the queue sizes are fractions of a cache size learned from the blocks seen
resident (`kvevict.policies.classic.base`).
"""

from kvevict.policies.classic.arc import ARC
from kvevict.policies.classic.gdsf import GDSF
from kvevict.policies.classic.s3fifo import S3FIFO
from kvevict.policies.classic.slru import SLRU, TwoQ

__all__ = ["ARC", "GDSF", "S3FIFO", "SLRU", "TwoQ"]
