"""Verified transfers for ``mooncake-ext`` (issue 16): where Mooncake's writes meet the digest.

Every engine write of SGLang's Mooncake manager (KV, paged state, Mamba slots,
the aux row) goes through ``_transfer_data(session, blocks)`` with
``(src, dst, length)`` blocks for one decode session: the digest is taken there,
before the engine reads the source. The rest (placement, partials, the status
frame, decode's check) is :mod:`.transfer_verify`'s.

Writes that bypass ``_transfer_data`` are not covered: 0.5.23's
heterogeneous-TP ``send_kvcache_slice`` (it calls the engine itself), staging,
the TCP aux path. Their pages are simply not listed, so decode does not check them.
"""

from __future__ import annotations

from sglang_disagg_ext.backends.transfer_verify import VerifiedTransferMixin, logger


class MooncakeVerifiedTransferMixin(VerifiedTransferMixin):
    """Mooncake's entry: the blocks of each ``_transfer_data`` call."""

    def _transfer_data(self, mooncake_session_id, transfer_blocks):
        """Stock ``_transfer_data``, after adding the blocks' digest to the room's partial.

        Contract: prefill only; every KV, state and aux write of the transfer worker
        (and of its executor's threads) goes through it with ``(src, dst, length)``
        blocks for one decode session; its rc is the engine's. The digest is taken
        before the engine reads the source (not beside it: a digest read while the
        engine reads would no longer pin the bytes prefill meant to send). Must never
        raise on the digest's account.
        """
        if self._verify_on and transfer_blocks:
            try:
                self._verify_add_blocks(mooncake_session_id, transfer_blocks)
            except Exception:  # noqa: BLE001 - verification must never fail a transfer by itself
                logger.exception("verified transfers: digest of a transfer failed; the room goes unverified")
                self._verify_mark_unplaced(mooncake_session_id, "digest raised")
        return super()._transfer_data(mooncake_session_id, transfer_blocks)
