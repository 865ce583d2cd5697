"""Devices widget: the device inventory as a sortable table."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anywidget
import traitlets

from workbench.widgets import _assets
from workbench.widgets._payload import devices_payload

__all__ = ["DevicesWidget", "devices_widget"]


class DevicesWidget(anywidget.AnyWidget):
    """Draws ``wb.devices()``: id, kind, platform, process, coords, core, memory, host."""

    _esm = _assets.esm("devices")
    _css = _assets.css("devices")
    payload = traitlets.Dict().tag(sync=True)

    def __init__(self, devices: Sequence[Any], **kwargs: Any) -> None:
        self._text = str(devices)
        super().__init__(payload=devices_payload(devices), **kwargs)

    def __repr__(self) -> str:
        return self._text


def devices_widget(devices: Any = None) -> DevicesWidget:
    """The device inventory widget (default: every device of the default backend)."""
    from workbench.hardware import DeviceInfo, DeviceInventory
    from workbench.hardware import devices as inventory

    if devices is None:
        return DevicesWidget(inventory())
    items = list(devices) if isinstance(devices, (list, tuple)) else [devices]
    return DevicesWidget(DeviceInventory(
        d if isinstance(d, DeviceInfo) else DeviceInfo.from_device(d) for d in items))
