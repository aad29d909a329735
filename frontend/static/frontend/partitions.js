// The partition form's Preview: fetch the server-drawn GPU for the form's fields and show it
// beside the form, without leaving the page. Without JavaScript the button opens the same
// fragment as a page of its own.
(function () {
  "use strict";

  function preview(form) {
    var target = document.querySelector(form.dataset.previewTarget);
    var fields = new URLSearchParams(new FormData(form));
    fields.delete("csrfmiddlewaretoken");
    fetch(form.dataset.previewUrl + "?" + fields.toString(), { credentials: "same-origin" })
      .then(function (response) {
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.text();
      })
      .then(function (html) { target.innerHTML = html; })
      .catch(function (error) { target.textContent = "Could not draw the preview (" + error.message + "); try again."; });
  }

  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-preview]");
    if (!button) return;
    event.preventDefault();
    preview(button.form);
  });
})();
