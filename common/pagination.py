"""The API's one pagination: ``?page=N`` where N is a positive integer, as the schema says, and
``?page_size=M``, at most MAX_PAGE_SIZE.

DRF's PageNumberPagination takes an empty ``?page=`` as page 1 and answers 404
"Invalid page." for ``?page=abc`` or ``?page=0``, which the schema (an integer)
does not describe. Here a value that is not a positive integer is a 400 that
names ``page``; a page past the last one is a 404, as documented on every
paginated list. Likewise ``page_size``: DRF quietly uses its default for a
value it cannot read, and its maximum for one above it; here either is a 400
naming ``page_size``, so a client never gets fewer rows than it asked for
without being told.
"""

from rest_framework import pagination
from rest_framework.exceptions import NotFound, ValidationError

from common.numbers import whole_number

PAGE_MESSAGE = "A page number is a positive integer: 1, 2, 3, ..."
# The most rows one page of any list holds, whatever the client asks (API_PAGE_SIZE is at most this).
MAX_PAGE_SIZE = 200


class PageNumberPagination(pagination.PageNumberPagination):
    last_page_strings = ()  # ?page=last is not in the schema.
    page_query_description = "A page number, from 1. A page past the last one is a 404."
    page_size_query_param = "page_size"
    max_page_size = MAX_PAGE_SIZE

    @property
    def page_size_query_description(self) -> str:
        return f"Rows a page holds, from 1 to {self.max_page_size} (default {self.default_page_size()})."

    def default_page_size(self) -> int:
        return min(self.page_size, self.max_page_size)

    def get_page_size(self, request):
        values = request.query_params.getlist(self.page_size_query_param)
        if not values:
            return self.default_page_size()
        number = whole_number(values[-1])
        if number is None or not 1 <= number <= self.max_page_size:
            raise ValidationError(
                {self.page_size_query_param: [f"A page size is a whole number from 1 to {self.max_page_size}."]}
            )
        return number

    def get_page_number(self, request, paginator):
        values = request.query_params.getlist(self.page_query_param)
        if not values:
            return 1
        raw = values[-1]  # The last one wins, as with any repeated query parameter here.
        if not (raw.isascii() and raw.isdigit()) or not raw.lstrip("0"):
            raise ValidationError({self.page_query_param: [PAGE_MESSAGE]})
        number = whole_number(raw)
        if number is None:  # longer than any table's last page
            raise NotFound(self.invalid_page_message)
        return number

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] == self.page_query_param:
                parameter["schema"] = {"type": "integer", "minimum": 1}
            elif parameter["name"] == self.page_size_query_param:
                parameter["schema"] = {"type": "integer", "minimum": 1, "maximum": self.max_page_size}
        return parameters
