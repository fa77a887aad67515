"""The host/device boundary: batch packing and the jitted model step."""
