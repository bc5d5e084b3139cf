"""``client.embeddings``: vectors of images, masked or not (``POST /embed``, or OpenAI's ``POST /v1/embeddings``)."""
from __future__ import annotations

import base64

from msn_serve.client.options import NOT_GIVEN, NotGiven, Timeout
from msn_serve.client.resource import Resource
from msn_serve.client.results import Embeddings, OpenAIEmbeddings
from msn_serve.client.wire import (
    ImageInput,
    Images,
    MaskInput,
    as_image_list,
    image_call,
    image_file,
    json_call,
    mask_spec,
)

RAW_F32 = "application/octet-stream"


def _data_url(image: ImageInput, i: int) -> str:
    if isinstance(image, str) and image.startswith(("data:", "http://", "https://")):
        return image  # already a data URL, or a URL the server fetches (when its operator enabled that)
    _, data, ctype = image_file(image, f"input[{i}]")
    return f"data:{'image/png' if ctype == 'image/png' else 'application/octet-stream'};base64," \
           + base64.b64encode(data).decode("ascii")


class EmbeddingsAPI(Resource):
    def create(self, input: Images, *, model: str | None = None, mask: MaskInput = None, normalize: bool = False,
               timeout: Timeout | NotGiven = NOT_GIVEN) -> Embeddings:
        """``POST /embed``: one embedding per image (``input``: one image or a list); masked when ``mask`` is given
        (then ``keep_idx`` says which patches each image kept). Unmasked answers come as raw float32 (no JSON
        text to parse)."""
        spec = mask_spec(mask)
        fields = {"mask": spec, "normalize": True if normalize else None, "model": self._model(model)}
        if spec is None:
            return self._do(image_call("POST", "/embed", Embeddings.from_binary, as_image_list(input), fields,
                                       raw=True, headers={"Accept": RAW_F32}, timeout=timeout))
        return self._do(image_call("POST", "/embed", Embeddings.from_json, as_image_list(input), fields,
                                   timeout=timeout))

    def create_v1(self, input: Images, *, model: str | None = None, mask: MaskInput = None,
                  timeout: Timeout | NotGiven = NOT_GIVEN) -> OpenAIEmbeddings:
        """``POST /v1/embeddings`` (OpenAI's route): the same vectors as :meth:`create`. A string starting with
        ``data:`` or ``http(s)://`` is sent as it is; other images as base64 data URLs."""
        inputs = [_data_url(im, i) for i, im in enumerate(as_image_list(input))]
        fields = {"model": self._model(model) or "msn", "input": inputs, "encoding_format": "base64",
                  "mask": mask_spec(mask)}
        return self._do(json_call("POST", "/v1/embeddings", OpenAIEmbeddings.from_json, fields, timeout=timeout))
