"""Protocol buffers of the ``dspine`` API."""
