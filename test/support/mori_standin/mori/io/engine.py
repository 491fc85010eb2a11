"""Snake-case engine wrapper, shaped like MoRI's ``python/mori/io/engine.py``.

``batch_write`` / ``batch_read`` take lists (one entry per transfer: a local
descriptor, its offsets, a remote descriptor, its offsets, sizes, a transfer
uid) and return one ``TransferStatus`` per transfer, as MoRI's wrapper does.
"""

from mori import cpp as mori_cpp

__all__ = ["IOEngine"]


class IOEngine:
    def __init__(self, key, config: mori_cpp.IOEngineConfig):
        self._engine = mori_cpp.IOEngine(key, config)

    def get_engine_desc(self):
        return self._engine.GetEngineDesc()

    def create_backend(self, type, config=None):
        if config is None:
            config = mori_cpp.RdmaBackendConfig() if type is mori_cpp.BackendType.RDMA else mori_cpp.TcpBackendConfig()
        return self._engine.CreateBackend(type, config)

    def remove_backend(self, type):
        return self._engine.RemoveBackend(type)

    def register_remote_engine(self, engine_desc):
        return self._engine.RegisterRemoteEngine(engine_desc)

    def deregister_remote_engine(self, engine_desc):
        return self._engine.DeregisterRemoteEngine(engine_desc)

    def register_memory(self, ptr: int, size: int, device_id: int, mem_loc):
        return self._engine.RegisterMemory(ptr, size, device_id, mem_loc)

    def register_torch_tensor(self, tensor):
        if not tensor.is_contiguous():
            raise RuntimeError("input tensor must be contiguous")
        device_id = tensor.device.index if tensor.device.index is not None else -1
        loc = mori_cpp.MemoryLocationType.GPU if tensor.device.type == "cuda" else mori_cpp.MemoryLocationType.CPU
        return self.register_memory(tensor.data_ptr(), tensor.nelement() * tensor.element_size(), device_id, loc)

    def deregister_memory(self, mem_desc):
        return self._engine.DeregisterMemory(mem_desc)

    def allocate_transfer_uid(self):
        return self._engine.AllocateTransferUniqueId()

    def _batch(self, func, local_descs, local_offsets, remote_descs, remote_offsets, sizes, transfer_uids):
        statuses = [mori_cpp.TransferStatus() for _ in range(len(sizes))]
        func(local_descs, local_offsets, remote_descs, remote_offsets, sizes, statuses, transfer_uids)
        return statuses

    def batch_write(self, *args):
        return self._batch(self._engine.BatchWrite, *args)

    def batch_read(self, *args):
        return self._batch(self._engine.BatchRead, *args)

    def write(self, local_desc, local_offset, remote_desc, remote_offset, size, transfer_uid):
        (status,) = self.batch_write([local_desc], [[local_offset]], [remote_desc], [[remote_offset]], [[size]],
                                     [transfer_uid])
        return status

    def read(self, local_desc, local_offset, remote_desc, remote_offset, size, transfer_uid):
        (status,) = self.batch_read([local_desc], [[local_offset]], [remote_desc], [[remote_offset]], [[size]],
                                    [transfer_uid])
        return status

    def wait_all(self, statuses, timeout_ms: int = -1):
        return self._engine.WaitAll(statuses, timeout_ms)

    def pop_inbound_transfer_status(self, remote_key, transfer_uid):
        return None
