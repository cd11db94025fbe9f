{{/* Chart name, truncated to a DNS label. */}}
{{- define "cispo.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name. */}}
{{- define "cispo.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of one component's objects: (dict "ctx" $ "component" "api"). */}}
{{- define "cispo.componentName" -}}
{{- $base := include "cispo.fullname" .ctx | trunc (int (sub 62 (len .component))) | trimSuffix "-" }}
{{- printf "%s-%s" $base .component }}
{{- end }}

{{- define "cispo.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object carries. */}}
{{- define "cispo.labels" -}}
helm.sh/chart: {{ include "cispo.chart" . }}
{{ include "cispo.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels; each workload adds app.kubernetes.io/component. */}}
{{- define "cispo.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cispo.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* repository:tag of one component: (dict "image" .Values.api.image "ctx" $). */}}
{{- define "cispo.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{/* The Secret the API and the workers read. */}}
{{- define "cispo.secretName" -}}
{{- if .Values.secrets.existingSecret }}
{{- .Values.secrets.existingSecret }}
{{- else }}
{{- include "cispo.fullname" . }}
{{- end }}
{{- end }}

{{/*
The Secret the migration hook reads. The chart's own Secret is not created
before pre-install hooks run, so the hook gets a copy of its own (a hook with a
lower weight, deleted once the hooks succeed).
*/}}
{{- define "cispo.migrationsSecretName" -}}
{{- if .Values.secrets.existingSecret }}
{{- .Values.secrets.existingSecret }}
{{- else }}
{{- include "cispo.componentName" (dict "ctx" . "component" "migrations") }}
{{- end }}
{{- end }}

{{/* Secret data (base64), shared by the Secret and the migration hook's copy. */}}
{{- define "cispo.secretData" -}}
DATABASE_URL: {{ required "set secrets.databaseUrl (or secrets.existingSecret)" .Values.secrets.databaseUrl | b64enc | quote }}
BROKER_URL: {{ required "set secrets.brokerUrl (or secrets.existingSecret)" .Values.secrets.brokerUrl | b64enc | quote }}
STORAGE_URL: {{ required "set secrets.storageUrl (or secrets.existingSecret)" .Values.secrets.storageUrl | b64enc | quote }}
{{- with .Values.secrets.awsAccessKeyId }}
AWS_ACCESS_KEY_ID: {{ . | b64enc | quote }}
{{- end }}
{{- with .Values.secrets.awsSecretAccessKey }}
AWS_SECRET_ACCESS_KEY: {{ . | b64enc | quote }}
{{- end }}
{{- with .Values.secrets.metricsToken }}
CISPO_METRICS_TOKEN: {{ . | b64enc | quote }}
{{- end }}
{{- with .Values.secrets.judgeApiKey }}
CISPO_JUDGE_API_KEY: {{ . | b64enc | quote }}
{{- end }}
CISPO_SECRET_KEY: {{ required "set secrets.secretKey (a Fernet key; or secrets.existingSecret)" .Values.secrets.secretKey | b64enc | quote }}
{{- end }}

{{/* Non-secret settings (service/settings.py), shared by the ConfigMap and the migration hook. */}}
{{- define "cispo.config" -}}
CISPO_HOME: {{ .Values.config.home | quote }}
CISPO_LEASE_TTL_S: {{ .Values.config.leaseTtlS | toString | quote }}
CISPO_HEARTBEAT_S: {{ .Values.config.heartbeatS | toString | quote }}
CISPO_MAX_UPLOAD_BYTES: {{ .Values.config.maxUploadBytes | int64 | toString | quote }}
CISPO_SANDBOX: {{ .Values.config.sandbox | quote }}
CISPO_SANDBOX_UID: {{ .Values.config.sandboxUid | int64 | toString | quote }}
CISPO_SANDBOX_UID_COUNT: {{ .Values.config.sandboxUidCount | int64 | toString | quote }}
CISPO_EGRESS_ALLOW: {{ .Values.config.egressAllow | quote }}
CISPO_JUDGE_BASE_URL: {{ .Values.config.judgeBaseUrl | quote }}
CISPO_JUDGE_MODELS: {{ .Values.config.judgeModels | quote }}
CISPO_RAY_ADDRESS: {{ include "cispo.rayAddress" . | quote }}
CISPO_RAY_GANG_TIMEOUT_S: {{ .Values.ray.gangTimeoutS | toString | quote }}
CISPO_WORKER_JOBS: {{ .Values.config.workerJobs | default 1 | toString | quote }}
CISPO_PROJECT_WEIGHTS: {{ .Values.config.projectWeights | toJson | quote }}
CISPO_WORKER_MEMORY_GIB: {{ .Values.config.workerMemoryGiB | default "" | toString | quote }}
CISPO_TINKER_BASE_MODELS: {{ join "," .Values.tinker.baseModels | quote }}
{{- range $key, $value := .Values.config.extraEnv }}
{{ $key }}: {{ $value | toString | quote }}
{{- end }}
{{- end }}

{{/* The config as a container's env list (for the hook, which runs before the ConfigMap exists). */}}
{{- define "cispo.configEnv" -}}
{{- $env := list }}
{{- range $key, $value := (include "cispo.config" . | fromYaml) }}
{{- $env = append $env (dict "name" $key "value" (toString $value)) }}
{{- end }}
{{- toYaml $env }}
{{- end }}

{{/* Pod annotations that roll the pods when the config or the chart's Secret change. */}}
{{- define "cispo.checksums" -}}
checksum/config: {{ include "cispo.config" . | sha256sum }}
{{- if not .Values.secrets.existingSecret }}
checksum/secret: {{ include "cispo.secretData" . | sha256sum }}
{{- end }}
{{- end }}

{{/*
The worker's security contexts. With config.sandbox "off" the worker runs no
user code and gets the API's strict ones: no root, no capabilities, nothing a
restricted namespace would refuse. Otherwise worker.podSecurityContext and
worker.containerSecurityContext: root and the capabilities the user-code
sandbox needs (values.yaml says which and why).
*/}}
{{- define "cispo.workerPodSecurityContext" -}}
{{- if eq .Values.config.sandbox "off" }}
{{- toYaml .Values.podSecurityContext }}
{{- else }}
{{- toYaml .Values.worker.podSecurityContext }}
{{- end }}
{{- end }}

{{/*
Kubernetes reads securityContext.appArmorProfile from 1.30 on; before that the
field does not exist, and "cispo.workerAppArmorAnnotation" sets the profile as
a pod annotation instead.
*/}}
{{- define "cispo.workerContainerSecurityContext" -}}
{{- if eq .Values.config.sandbox "off" }}
{{- toYaml .Values.containerSecurityContext }}
{{- else }}
{{- $sc := .Values.worker.containerSecurityContext }}
{{- if semverCompare "<1.30-0" .Capabilities.KubeVersion.Version }}
{{- $sc = omit $sc "appArmorProfile" }}
{{- end }}
{{- toYaml $sc }}
{{- end }}
{{- end }}

{{/* Before Kubernetes 1.30: worker.containerSecurityContext.appArmorProfile as the pod annotation. */}}
{{- define "cispo.workerAppArmorAnnotation" -}}
{{- $profile := .Values.worker.containerSecurityContext.appArmorProfile }}
{{- if and (ne .Values.config.sandbox "off") $profile (semverCompare "<1.30-0" .Capabilities.KubeVersion.Version) }}
{{- $value := "unconfined" }}
{{- if eq $profile.type "RuntimeDefault" }}
{{- $value = "runtime/default" }}
{{- else if eq $profile.type "Localhost" }}
{{- $value = printf "localhost/%s" $profile.localhostProfile }}
{{- end }}
container.apparmor.security.beta.kubernetes.io/worker: {{ $value | quote }}
{{- end }}
{{- end }}

{{/* CISPO_RAY_ADDRESS: ray.address, else the chart's RayCluster head through Ray Client (KubeRay names its
Service <cluster>-head-svc), else empty (no Ray: jobs with nodes > 1 are refused at create). */}}
{{- define "cispo.rayAddress" -}}
{{- if .Values.ray.address }}
{{- .Values.ray.address }}
{{- else if .Values.ray.enabled }}
{{- printf "ray://%s-head-svc:10001" (include "cispo.componentName" (dict "ctx" . "component" "ray")) }}
{{- end }}
{{- end }}
