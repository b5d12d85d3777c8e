{{/* Names, labels and images shared by every template. */}}

{{- define "loraplane.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "loraplane.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "loraplane.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "loraplane.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: loraplane
{{- end -}}

{{/* Selector labels of one component: include "loraplane.selectorLabels" (list . "operator") */}}
{{- define "loraplane.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "loraplane.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* "true" when pods run under the local pod runner (`localRun`: forced, or `auto` and a
     node labelled loraplane.io/local-runner=true exists), else empty. */}}
{{- define "loraplane.localRun" -}}
{{- $mode := toString .Values.localRun -}}
{{- if eq $mode "true" -}}
true
{{- else if eq $mode "auto" -}}
{{- $found := false -}}
{{- range (dig "items" (list) (lookup "v1" "Node" "" "")) -}}
{{- if eq (dig "metadata" "labels" "loraplane.io/local-runner" "" .) "true" -}}
{{- $found = true -}}
{{- end -}}
{{- end -}}
{{- if $found -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* Pod labels of one component, with the local-run opt-in under localRun. */}}
{{- define "loraplane.podLabels" -}}
{{- $root := index . 0 -}}
{{ include "loraplane.selectorLabels" . }}
{{- if include "loraplane.localRun" $root }}
loraplane.io/local-run: "true"
{{- end }}
{{- end -}}

{{- define "loraplane.image" -}}
{{- $root := index . 0 -}}
{{- $image := index . 1 -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}

{{- define "loraplane.adminSecret" -}}
{{- default (printf "%s-admin" (include "loraplane.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* Address servers bind to: the pod IP under localRun (one loopback address per pod). */}}
{{- define "loraplane.bindHost" -}}
{{- if include "loraplane.localRun" . -}}$(POD_IP){{- else -}}0.0.0.0{{- end -}}
{{- end -}}

{{/* The control plane's writable directory: its /data emptyDir, or under localRun (a
     process, no volumes) /tmp/loraplane-<pod uid> ($(POD_UID) is set in its env). */}}
{{- define "loraplane.dataDir" -}}
{{- if include "loraplane.localRun" . -}}/tmp/loraplane-$(POD_UID){{- else -}}/data{{- end -}}
{{- end -}}

{{- define "loraplane.databaseUrl" -}}
{{- if .Values.controlplane.database.url -}}
{{- .Values.controlplane.database.url -}}
{{- else if .Values.postgresql.enabled -}}
{{- printf "postgresql+psycopg://%s:$(POSTGRES_PASSWORD)@%s-postgresql:5432/%s" .Values.postgresql.username (include "loraplane.fullname" .) .Values.postgresql.database -}}
{{- else if include "loraplane.localRun" . -}}
sqlite:////tmp/loraplane-$(POD_UID).db
{{- else -}}
sqlite:////data/loraplane.db
{{- end -}}
{{- end -}}

{{- define "loraplane.redisUrl" -}}
{{- if .Values.controlplane.redis.url -}}
{{- .Values.controlplane.redis.url -}}
{{- else if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:6379/0" (include "loraplane.fullname" .) -}}
{{- end -}}
{{- end -}}
