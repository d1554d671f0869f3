"""The normalisation layers by torch's public classes (what the BatchNorm guard, the bf16
optimizer state and the dtype plan look for): torch's own base classes are private. timm's
BatchNormAct2d and a LazyBatchNorm once materialised are BatchNorm2d / BatchNorm1d too."""

from torch import nn

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
